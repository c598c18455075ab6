"""What every floor may use: one-line errors for bad input, value and type checks, CUDA and kernel settings, atomic
files, downloads, log routing and the stop signals the ranks agree on."""
