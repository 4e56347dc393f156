"""`python -m darkroom` is the `darkroom` console command."""

from darkroom.cli import main

# Guarded: render child processes re-import the parent's main module as __mp_main__.
if __name__ == "__main__":
    raise SystemExit(main())
