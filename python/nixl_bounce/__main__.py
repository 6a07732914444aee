"""`python -m nixl_bounce ...` is the same as the `nixl-bounce` command."""
from nixl_bounce.cli import main

raise SystemExit(main())
