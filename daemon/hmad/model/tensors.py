"""Moved to ``hmad.core.tensors``: its old name, until every importer uses the new one."""

import sys

import hmad.core.tensors

sys.modules[__name__] = hmad.core.tensors
