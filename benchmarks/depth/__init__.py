"""Quality against depth: the methods' tables and curves, and the references they are checked against."""
