import sys

from pathkernels.cli import main

sys.exit(main())
