"""Step-level simulation of the strategies on many unequal workers, at scales no machine here has."""
