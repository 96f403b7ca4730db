"""Tools around the loop: parity, benchmark, gin config descriptions."""
