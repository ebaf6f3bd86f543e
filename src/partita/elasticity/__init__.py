"""Job morphing: resume from the latest checkpoint, re-plan for the world found, stop cleanly when asked.

`loop` holds `partita.elastic`, the training loop helper; `stop` turns signals and stop files into a request
that the loop acts on between steps, and names the exit status of a job that stopped to be resumed. Nothing
is imported here, so that launchers can read `stop` without importing torch.
"""
