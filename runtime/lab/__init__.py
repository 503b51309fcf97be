"""The tuning lab: ``specrt bench`` (:mod:`.bench`), ``specrt tune`` (:mod:`.tune`), round
traces (:mod:`.trace`), offline replay of policies (:mod:`.replay`) and draft calibration
(:mod:`.calibration`). None of it is on the token path."""
