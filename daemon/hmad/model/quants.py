"""Moved to ``hmad.core.quants``: its old name, until every importer uses the new one."""

import sys

import hmad.core.quants

sys.modules[__name__] = hmad.core.quants
