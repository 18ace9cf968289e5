"""The prefix/segment cache redknot registers as SGLang radix-cache backend ``redknot``."""
