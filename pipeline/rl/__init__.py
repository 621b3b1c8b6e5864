"""The RL phase's library: pure tensor maths (:mod:`pipeline.rl.core_algos`) and sampling state (:mod:`pipeline.rl.sampling`)."""
