"""The RL phase's library: pure tensor maths (:mod:`pipeline.train.core_algos`) and sampling state (:mod:`pipeline.train.sampling`)."""
