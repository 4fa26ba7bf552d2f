"""Reading results: RLinf training curves (curves.py) and, from the proxy's audit log, the
reward-quality report (report.py: audit.py streams the log, quality.py computes the numbers,
progress_quality.py measures /progress/batch lines apart, monitor_lines.py the live monitor's
alarm and probe lines, quality_figures.py / contact_sheet.py draw, quality_html.py writes the
page). One plotting home (plotting.py) serves both.

Depends on vlm_protocol only; matplotlib and tensorboard are imported when a command runs
(`pip install 'vlm-reward-proxy[reports]'`).
"""
