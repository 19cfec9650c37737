// Placeholder source for a module library with no sources yet.
