import sys

from vlm_reward_cli import main

sys.exit(main())
