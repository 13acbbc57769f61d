import sys

from memra.cli import main

sys.exit(main())
