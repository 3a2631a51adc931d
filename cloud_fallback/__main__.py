"""`python -m cloud_fallback`: the worker on its own, without the CLI package."""
import sys

from cloud_fallback.worker_main import main

sys.exit(main())
