import sys

from tests.perf.run import main

sys.exit(main())
