import sys

from fastdp.cli import main

sys.exit(main())
