"""Mixture of experts (issue 19): the MoEfied model's runtime (expert tiers, predictors)."""
