import sys

from hostavg.cli import main

sys.exit(main())
