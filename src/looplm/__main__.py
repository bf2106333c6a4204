import sys

from looplm.cli import main

sys.exit(main())
