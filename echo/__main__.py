"""``python -m echo``: see echo/cli.py."""

from echo.cli import main

raise SystemExit(main())
