"""The reference downstream jobs (spark_flows.py, flink_flows.py) and the contract they share (contract.py).

Each job also runs as a plain script, copied elsewhere with contract.py beside it (README "Downstream").
"""
