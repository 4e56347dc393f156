"""`python -m darkroom` is the `darkroom` console command."""

from darkroom.cli import main

raise SystemExit(main())
