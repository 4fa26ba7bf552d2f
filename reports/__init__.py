"""Reading results: RLinf training curves (curves.py) and, from the proxy's audit log, the
reward-quality report (quality.py). One plotting home (plotting.py) serves both.

Depends on vlm_protocol only; matplotlib and tensorboard are imported when a command runs
(`pip install 'vlm-reward-proxy[reports]'`).
"""
