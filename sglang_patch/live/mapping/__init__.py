"""What live apply may patch and where: the engines it covers (scope), the coordinate map from
checkpoint elements to parameter elements and its proof steps, state a loader derives (MLA),
and what an update changes on one rank (stage).
"""
