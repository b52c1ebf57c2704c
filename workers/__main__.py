from commlab.exiting import exit_now
from workers.loop import main

exit_now(main())  # done: results written and printed (commlab.exiting says why and what it keeps)
