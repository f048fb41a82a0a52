"""`perfx serve`: an OpenAI-compatible HTTP server for one model on one device.

Standard library only: one device runs one generation at a time, so an async stack would buy nothing, and
on a phone (Termux) every dependency is one more thing to build (docs/serve.md says more). The layers, each
importing only the ones before it:

- ``api``: OpenAI's API, requests checked into what perfx runs and answers shaped as OpenAI's (pure);
- ``engine``: the model, loaded and owned by one worker thread that runs jobs from a bounded FIFO queue and
  reuses the KV cache across requests that share a prefix (the only user of perfx's model APIs);
- ``server``: HTTP on ThreadingHTTPServer, a thread per connection, streaming and disconnect detection;
- ``perfx.commands.serve``: the command, its options and a clean stop on SIGINT or SIGTERM.
"""
