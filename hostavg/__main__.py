import sys

from hostavg.cli.main import main

sys.exit(main())
