from commlab.launch.exiting import exit_now
from workers.loop import main

exit_now(main())  # done: results written and printed (commlab.launch.exiting says why and what it keeps)
