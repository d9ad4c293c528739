"""Moved to ``hmad.core.errors``: its old name, until every importer uses the new one."""

import sys

import hmad.core.errors

sys.modules[__name__] = hmad.core.errors
