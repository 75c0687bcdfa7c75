"""``python -m distlm.parity``: a layout against one process, update by update, and the
first module where they part (see ``__main__``). A tool: it imports the training core,
which never imports it."""
