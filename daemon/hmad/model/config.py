"""Moved to ``hmad.core.model_config``: its old name, until every importer uses the new one."""

import sys

import hmad.core.model_config

sys.modules[__name__] = hmad.core.model_config
