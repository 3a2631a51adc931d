"""`python -m edge_cli`: the same as the `edge-runtime` command."""
import sys

from edge_cli.main import main

sys.exit(main())
