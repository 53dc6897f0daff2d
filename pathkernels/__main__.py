import sys

from pathkernels.app.cli import main

sys.exit(main())
