"""The operator's tools: commands behind the CLI, progress, charts and the web page.
Imported by nothing but the command line."""
