import sys

from looplm.commands import main

sys.exit(main())
