import gc
import sys

from .cli import main

# The process is the command's own: what the modules imported by now hold (torch's most of some 200k
# objects) never becomes garbage, so the collector stops walking it. A full collection walked it all:
# 0.10 s of the load (models.return_freed_memory), and as long at each one while serving, every thread
# stopped. (A library cannot do this for its host: the host's own objects would never be collected.)
gc.freeze()
sys.exit(main())
