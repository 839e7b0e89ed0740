"""Who computes how much: apportionment, weighted sampling, the adaptive rule and the C-ADP planner."""
