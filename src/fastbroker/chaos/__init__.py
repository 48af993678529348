"""The fault-injection suite (issue 17): histories of what clients did and saw while a
nemesis broke the cluster, and the checker that finds anomalies in them."""
