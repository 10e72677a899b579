"""Integrations with other libraries (OpenMMLab's mmcv)."""
