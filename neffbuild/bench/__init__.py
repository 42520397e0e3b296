"""``neffbuild bench``: what a decode step costs, measured side by side in one run.

steps.py    step time of the bucketed / fallback / dynamic-width / eager variants
bytes.py    bytes a step must read and the machine's copy bandwidth (the bound)
overhead.py cold start vs compile at start-up, plan + metadata, DP sync vs bare gloo
report.py   the table and the PNG plot
"""
