"""The model catalogue: what ``GET /v1/models`` (and ``/v1/models/{name}``,
``/serve/{model}/v1/models``) lists, in the OpenAI card shape with vLLM's extra fields.

A card per name and alias of the configured models, then a card per LoRA adapter name and alias
(configured ones, then those found in the models' ``adapters_dir`` folders), each only where the
request's API key may use the model. The cards add what a client of this proxy wants to see:
``state`` (the model's public state; for an adapter, whether a serving engine holds it) and, for
an adapter, the instances holding it.
"""

from __future__ import annotations

from typing import Any

from ...pool.manager import Manager
from ...pool.views import Model, instances
from ..keys import Scope

OWNER = "vllm-proxy"


class Catalogue:
    """Cards of the models and adapters of one `Manager`, as its config stands now."""

    def __init__(self, manager: Manager, created: int) -> None:
        self.manager = manager
        #: The cards' ``created``: when this proxy started.
        self.created = created

    async def cards(self, scope: Scope | None) -> list[dict[str, Any]]:
        """Every card the scope (None: every model) may see: models first, then adapters."""
        return self.model_cards(scope) + await self.adapter_cards(scope)

    async def card(self, scope: Scope | None, name: str) -> dict[str, Any] | None:
        """The card of `name` (a model, alias, adapter or adapter alias), if `scope` sees it."""
        for card in self.model_cards(scope):
            if card["id"] == name:
                return card
        for card in await self.adapter_cards(scope):
            if card["id"] == name:
                return card
        return None

    def model_cards(self, scope: Scope | None) -> list[dict[str, Any]]:
        """A card per name and alias of the models `scope` allows."""
        cards = []
        for name, target in self.manager.names.items():
            model = self.manager.models[target]
            if scope is not None and not scope.allows(model.name, model.spec.aliases):
                continue
            cards.append(
                {
                    "id": name,
                    "object": "model",
                    "created": self.created,
                    "owned_by": OWNER,
                    "root": model.spec.model,
                    "parent": None if name == target else target,
                    "state": model.state().value,
                }
            )
        return cards

    async def adapter_cards(self, scope: Scope | None) -> list[dict[str, Any]]:
        """A card per LoRA adapter name and alias (of the models `scope` allows), as vLLM lists
        adapters: ``parent`` is the base model, ``root`` the adapter's path; ``state`` says
        whether a serving engine holds it (``loaded``, ``loading``, ``not_loaded``) and
        ``instances`` which; an alias's card names its ``adapter``."""

        def visible(m: Model) -> bool:
            return scope is None or scope.allows(m.name, m.spec.aliases)

        cards = []
        for name, model, adapter in await self.manager.adapter_entries(visible):
            held = {i.id: i.adapters.get(adapter.name) for i in instances(model)}
            states = set(held.values())
            state = "loaded" if "loaded" in states else "loading" if "loading" in states else None
            card = {
                "id": name,
                "object": "model",
                "created": self.created,
                "owned_by": OWNER,
                "root": adapter.path,
                "parent": model.name,
                "state": state or "not_loaded",
                "instances": sorted(iid for iid, st in held.items() if st is not None),
            }
            if name != adapter.name:
                card["adapter"] = adapter.name
            cards.append(card)
        return cards
