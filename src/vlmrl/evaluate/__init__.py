"""Stages 5 and 7: the held-out set evaluated into per-sample records (`stage`), and the visual control, the
same items with their images swapped (`visual_control`)."""
