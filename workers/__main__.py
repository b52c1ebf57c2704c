import sys

from workers.loop import main

sys.exit(main())
