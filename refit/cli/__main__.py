import sys

from refit.cli.main import main

sys.exit(main())
