"""The HTTP routes, one module per family; each reaches the serving layer through `serving()`."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from tiered.api.serving import Serving


def serving(request: Request) -> Serving:
    """FastAPI dependency: the app's serving layer (set by `app.build_app`)."""
    return request.app.state.serving  # type: ignore[no-any-return]


ServingDep = Annotated[Serving, Depends(serving)]
