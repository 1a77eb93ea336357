"""The scratch tree → the allocation model: the resource.txt parser, the immutable allocation
book, the safe reader and the inotify watcher. Imports nothing else from the package but ``units``."""
