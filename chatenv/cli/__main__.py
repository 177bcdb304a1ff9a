"""``python -m chatenv.cli``."""

from chatenv.cli import main

raise SystemExit(main())
