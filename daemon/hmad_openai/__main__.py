"""``python -m hmad_openai`` and the ``hmad-openai`` console script: the gateway's command line
(``hmad_openai.cli``), or, when the ``openai`` extra is not installed, one line saying how to install it and
exit status 2 (as ``hmactl metrics --prometheus`` does), not a ModuleNotFoundError traceback.
"""

from __future__ import annotations

import importlib.util
import sys

#: the third-party modules the gateway imports that only the ``openai`` extra (pyproject.toml) brings
EXTRA_MODULES = ("uvicorn", "h11", "starlette", "prometheus_client")
INSTALL_HINT = "pip install 'hmad[openai]' (for the service: /opt/hmad/venv/bin/pip install 'hmad[openai]')"
EXIT_USAGE = 2


def missing_extra() -> str | None:
    """The first of EXTRA_MODULES that cannot be imported here, or None when the extra is installed."""
    return next((name for name in EXTRA_MODULES if importlib.util.find_spec(name) is None), None)


def main(argv: list[str] | None = None) -> int:
    try:
        from hmad_openai.cli import main as serve
    except ModuleNotFoundError as e:
        top = (e.name or "").partition(".")[0]
        if top not in EXTRA_MODULES:
            raise
        print(f"hmad-openai: {top} is not installed: {INSTALL_HINT}", file=sys.stderr)
        return EXIT_USAGE
    return serve(argv)


if __name__ == "__main__":
    sys.exit(main())
