"""The algorithmic core: the decode loop of one request (`engine`) and of many (`batch`, with
`scheduler`), acceptance rules, draft-length control, sampling, statistics, the drafters, and the
named recipes every shell offers (`methods`). It drives a target through the interface of
`target.sequence.TargetSequence` and knows nothing of how that target runs: `engine`,
`acceptance`, `sampling`, `control`, `stats` and the n-gram drafters never reach the runtime.
"""
