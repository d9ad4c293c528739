"""Moved to ``hmad.core.batch``: its old name, until every importer uses the new one."""

import sys

import hmad.core.batch

sys.modules[__name__] = hmad.core.batch
