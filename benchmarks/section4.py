"""FusionAI section 4 reproduced: 50 x RTX 3080 vs 4 x H100 on Bert-Large and a GPT-3-style model.

Thin wrapper over ``fusionnet.perfmodel.section4.main``: prints the latency / throughput table for a
sweep of bandwidths and latencies, writes a PNG plot (matplotlib, the ``plot`` extra) and ends with
a JSON line of 3080-vs-H100 ratios.

    python benchmarks/section4.py [--plot section4.png] [--json rows.json] [--n-batches 512]
"""

from __future__ import annotations

import sys

from fusionnet.perfmodel.section4 import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
