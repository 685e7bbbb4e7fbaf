"""Build a small local Llama for the engine tests (no hub): see pof_connector/bench/make_model.py.

    python ci/make_model.py --preset tiny|bench --out DIR
"""

import sys

from pof_connector.bench.make_model import main

if __name__ == "__main__":
    sys.exit(main())
