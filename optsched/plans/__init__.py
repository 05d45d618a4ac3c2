"""Plans: the `Plan` a planning run reports (`plan`), plan files (`file_format`), and replaying a
file on the graph at hand without solving (`reuse`)."""
