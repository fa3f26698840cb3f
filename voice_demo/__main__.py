import sys

from voice_demo.cli import main

sys.exit(main())
